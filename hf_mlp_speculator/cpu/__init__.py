"""CPU decoding: plain, transposed or packed weights forward by forward, and grouped heads read in place."""
