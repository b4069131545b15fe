"""cmlcluster's stand-in for CML's `cml` package (see cmlcluster.cml_shim): only where no real one is installed."""
