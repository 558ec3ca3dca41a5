"""A Trainer subclass for a model outside the zoo, run from the command line by its config."""
