//! Test helpers: the mock LLM.
