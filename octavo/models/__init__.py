"""Model definitions, the supported-architecture registry and the weight loader; no engine imports."""
