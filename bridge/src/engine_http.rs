//! The engines' HTTP APIs: health, model and cache facts, load, and OpenAI completions.
//! (In progress.)
