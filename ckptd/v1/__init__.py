"""gRPC code generated from proto/ckptd/v1 at build time (setup.py); never edited by hand."""
