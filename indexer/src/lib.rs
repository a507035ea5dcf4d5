//! kvroute's indexer: the radix index of which worker holds which prefix.
