"""Ray entry points. Thin: they wire `blockpilot` library functions into Ray Data, Train and Serve."""
