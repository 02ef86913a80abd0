"""Code shared by the test files: CLI runners, reference models, benchmark loaders."""
