"""Token-bucket rate limits with GPU-watermark backpressure ([[ratelimits]])."""
