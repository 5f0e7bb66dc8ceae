"""Parameter-server training: `ParameterServerStrategy` and its synchronous mode."""
