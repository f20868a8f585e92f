"""The speculator models, in transformers' layout: the configuration as plain data, and the modules."""
