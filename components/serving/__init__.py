"""Serving: the Ray Serve app of target + drafter replicas behind an OpenAI-compatible API.

* ``protocol``  -- request bodies → checked ``GenerateParams``, or an ``APIError`` naming the field;
* ``responses`` -- completion / chat bodies, SSE chunks, per-request speculative statistics;
* ``detokenizer`` -- token ids → text deltas, stop strings matched across tokens, never leaked;
* ``replica``   -- one engine's admission (overload → 503/429 + Retry-After), generation, health;
* ``parts``     -- target, drafter and batch engine from the config (adaptive cap, stored profile);
* ``fallback``  -- a drafter wrapper: a drafter failure turns the affected requests plain, losslessly;
* ``telemetry`` -- vLLM-named metrics into Ray and this replica's ``/metrics``;
* ``provenance`` -- which drafter checkpoint is served (path, MLflow run id, the train stage's);
* ``app``       -- the FastAPI routes and the Serve deployment (``build_app``, ``deployment_options``).

Importing this package imports nothing (FastAPI and Ray are imported by ``app`` when used).
"""
