"""Drawing session events: plain text here; widgets subscribe the same way."""
