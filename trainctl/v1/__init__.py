"""Generated gRPC code for proto/trainctl/v1/training.proto (regenerate with `make proto`)."""
