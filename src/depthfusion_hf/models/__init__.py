"""The model families. Each folder is self-contained so that it can be exported as remote code."""
