import sys

from distopt.cli import main

sys.exit(main())
