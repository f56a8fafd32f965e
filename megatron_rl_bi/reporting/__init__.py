"""What results carry with them (device, commit, versions) and where metrics are written."""
