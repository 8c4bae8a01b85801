"""The bootstrap service (port 8998): the registry of workers that the router discovers its pairs from."""
