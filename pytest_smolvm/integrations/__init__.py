"""Adapters that let other harnesses use smolvm guests; each is imported only by its harness."""
