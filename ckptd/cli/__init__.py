"""Command-line interfaces: ckptd (launch, daemons) and ckptctl (control)."""

import os

# gRPC's C core logs refused TLS handshakes on stderr at INFO level; the CLI
# says what went wrong in its own one-line error instead
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
