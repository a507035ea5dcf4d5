//! (In progress.)
