"""How the daemon is reached: the ZeroMQ server, the loopback HTTP listener, systemd notifications."""
