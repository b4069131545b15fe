"""Unit tests, laid out like the package: tests/unit/<package>/test_<module>.py."""
