"""DSA model that reads and writes the paged pool through BufferKeys; HF loader; tiny checkpoint maker."""
