"""Runnable examples; a package so that `config.trainer` can name `examples.<module>:<Class>`."""
