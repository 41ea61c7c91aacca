"""Markers of the fast suite (the integration suite registers its own)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "distributed: runs several processes with torch.distributed.run (gloo)"
    )
