"""Capture coverage on third-party models: does distopt return a correct model for each?"""

from distopt.coverage.corpus import CorpusEntry, corpus
from distopt.coverage.run import CoverageRow, check_model, run_corpus

__all__ = ["CorpusEntry", "CoverageRow", "check_model", "corpus", "run_corpus"]
