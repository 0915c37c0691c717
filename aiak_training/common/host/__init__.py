"""This host and this installation: what the build can do (``build_info``) and the network
interfaces and addresses every layer looks up (``net``)."""
