"""The version of cmlcluster: one place, read by the package face and by what checks a worker host."""

__version__ = "0.1.0"
