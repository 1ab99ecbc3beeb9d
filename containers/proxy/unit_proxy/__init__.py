"""Streaming reverse proxy beside each unit leader: health, load, admission, drain."""
