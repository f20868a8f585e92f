"""Packed or plain weights on CPU, forward by forward, whichever measures faster."""
