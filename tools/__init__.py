"""Developer tools that are not tests: the mutation harness and the import-graph check."""
