//! kvroute's mocker: simulated inference workers and trace replay.
