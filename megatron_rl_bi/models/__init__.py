"""Model definitions shared by trainer and engine: layer specs and the modules they pick."""
