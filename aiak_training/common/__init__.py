"""Framework-agnostic core: engine, negotiation, topology, process sets."""
