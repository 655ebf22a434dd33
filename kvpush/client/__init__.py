"""The control plane's client SDK, for the router, the sidecars, the CLI and the
benchmarks: ``control_plane.ControlPlaneClient`` (channel, TLS, bearer token, the three
services' stubs) and ``reserve_stream.StreamReserver`` (many Reserves over one stream)."""
