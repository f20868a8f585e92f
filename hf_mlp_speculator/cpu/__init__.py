"""Plain, transposed or packed weights on CPU, forward by forward, whichever measures fastest."""
