"""User jobs written as people outside distopt write them (see README.md here)."""
