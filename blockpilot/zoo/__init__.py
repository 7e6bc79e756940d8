"""The local model zoo: tokenizers, targets and drafters made here, with no hub."""
