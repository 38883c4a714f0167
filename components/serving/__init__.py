"""Serving: the Ray Serve app of target + drafter replicas behind an OpenAI-compatible API.

* ``protocol``    -- request bodies → checked ``GenerateParams`` (or an ``APIError`` naming the field),
                     the tokenizer routes' bodies;
* ``responses``   -- completion / chat bodies, SSE chunks, the model card, per-request speculative statistics;
* ``detokenizer`` -- token ids → text deltas, stop strings matched across tokens, never leaked;
* ``replica``     -- one engine's admission (overload → 503/429 + Retry-After) and generation;
* ``lifecycle``   -- warming up → ok | dead: what /health, Serve's health check and the routes answer;
* ``counters``    -- the engine's counters (diffed by field name) and each request's latencies → metrics;
* ``assemble``    -- target, drafter and batch engine from the config (adaptive cap, stored profile);
* ``fallback``    -- a drafter wrapper: a drafter failure turns the affected requests plain, losslessly;
* ``telemetry``   -- vLLM-named metrics into Ray and this replica's ``/metrics``;
* ``provenance``  -- which drafter checkpoint is served (path, MLflow run id, the train stage's);
* ``auth``        -- the API key on every route but the public ones (a FastAPI dependency);
* ``generation``  -- one generation request over HTTP: admission, first output, SSE or JSON;
* ``app``         -- the route table and the Serve deployment (``build_app``, ``deployment_options``).

Importing this package imports nothing (FastAPI and Ray are imported by ``app`` when used).
"""
