"""Command-line interfaces: ckptd (launch, daemons) and ckptctl (control)."""
