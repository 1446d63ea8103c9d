"""Local harness: real redis-server processes, the stub provider, the fleet, service start-up."""
