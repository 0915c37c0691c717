"""The elastic driver behind ``aiakrun --host-discovery-script`` / ``--min-np`` (Horovod's
elastic mode, on the Gloo transport)."""
