"""aiproxy: an AI-native edge reverse proxy."""

__version__ = "0.1.0"
