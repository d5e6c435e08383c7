"""Generated gRPC code for ``protos/psgd/v1/ps.proto`` (regenerate with ``python -m psgd.proto.codegen``)."""
