"""Thin Prefect tasks over graphstore / runner functions; they return small references.

The store is the only cache: each task asks the store whether its artefact exists for its
fingerprint and reports the stage as ``cached`` when it does (no Prefect result cache)."""
