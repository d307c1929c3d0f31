"""Every setting of kvstitch, read from `KVSTITCH_*` environment variables or a `.env` file.

Only entry points (the CLI, the gateway's app factory, the worker) build a `Settings`; everything below them
takes plain arguments, so the core never reads the environment. Each field's description is what the README's
settings table shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.engine import batching_defaults
from service.engine.recompute_spec import parse_recompute
from service.quality.measured import MEASURED
from service.search_filter import KEY_PATTERN as FILTER_KEY
from service.search_filter import MAX_KEY_CHARS as MAX_FILTER_KEY_CHARS

MIB = 1 << 20
ENGINES_FROM_REDIS = "redis"  # KVSTITCH_ENGINES's value for the engines that announce themselves in Redis
# The context temperature's bounds (the setting's and `kvstitch eval`'s): past them a context is all but ignored or
# all but argmaxed.
CONTEXT_TEMPERATURE_RANGE = (0.25, 4.0)
MAX_INSTRUCTION_CHARS = 2000  # an instruction added to the system message (kvstitch eval, finetune)


class Settings(BaseSettings):
    """The deployment's configuration; `KVSTITCH_<FIELD>` overrides each field (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="KVSTITCH_", env_file=".env", extra="ignore")

    # ---- model and engine ----------------------------------------------------------------------------------
    model: str = Field("", description="LLM: a Hugging Face folder or a hub id already in the local cache.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the LLM runs; auto = cuda if present.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="LLM dtype; auto = bfloat16 on cuda, float32 on cpu."
    )
    gate_on_start: bool = Field(True, description="Run the stitching correctness gate before reporting ready.")
    gate_tolerance: float | None = Field(
        None,
        gt=0,
        description="Gate tolerance (largest logit difference); default the larger of 1e-4 and 1e-5 of the logit "
        "scale in fp32, 10% of it in bf16.",
    )

    # ---- storage -------------------------------------------------------------------------------------------
    data_dir: Path = Field(Path("data"), description="Embedded Qdrant, the embedded KV index and the KV files.")
    cache_dir: Path | None = Field(None, description="KV block files (an NVMe path); default DATA_DIR/kv.")
    redis_url: str | None = Field(
        None, description="Redis for the KV index, ingest queue and job status; unset = embedded, in-process."
    )
    redis_prefix: str = Field(
        "kvstitch", min_length=1, description="Prefix of every Redis key, so deployments can share one Redis."
    )
    engine_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="Publish this engine's KV tier changes to Redis under this id, for a gateway's chunk-aware "
        "routing; unset = nothing published. Needs KVSTITCH_REDIS_URL.",
    )
    fleet_ttl_s: float = Field(
        15.0, gt=0, description="An engine that has not beaten its heartbeat in Redis for this long leaves routing."
    )
    engines: str = Field(
        "",
        max_length=8192,
        description="Gateway mode: the engines `kvstitch serve` sends questions to, comma-separated URLs of "
        "`kvstitch engine` processes (http://host:8100,...), or `redis` for the engines that announce themselves in "
        "Redis; unset = answers in this process (embedded engine).",
    )
    engine_url: str | None = Field(
        None,
        max_length=512,
        description="`kvstitch engine`: the URL gateways reach its internal API at, announced in Redis; unset = "
        "http://HOST:PORT (HOST 127.0.0.1 when it listens on every address).",
    )
    engine_api_process: bool = Field(
        True,
        description="`kvstitch engine`: serve the internal HTTP API from a second process, so that writing every "
        "running answer's lines does not share the engine thread's GIL (the core process sends each decode step's "
        "lines in one message); false serves it from the engine's own process.",
    )
    fleet_balance_abs: int = Field(
        32,
        ge=0,
        le=100_000,
        description="Gateway mode: a question goes to the least loaded engine when the busiest runs this many more "
        "requests than the idlest (and FLEET_BALANCE_REL times as many); otherwise to the cheapest by chunk tiers.",
    )
    fleet_balance_rel: float = Field(
        1.5, ge=1.0, le=1000.0, description="Gateway mode: the relative half of the imbalance bound (SGLang's rule)."
    )
    fleet_load_cost_tokens: float = Field(
        64.0,
        ge=0.0,
        le=1_000_000.0,
        description="Gateway mode, chunk-aware: one running answer on an engine weighs as much as computing this many "
        "tokens' KV; a chunk on the GPU instead of the host saves 0.05 of its tokens, so a smaller weight lets "
        "residency decide more questions and load fewer.",
    )
    fleet_routing: Literal["chunk-aware", "round-robin"] = Field(
        "chunk-aware",
        description="Gateway mode: how a question's engine is chosen: by where its chunks' KV sits and the load "
        "(chunk-aware), or each engine in turn (round-robin: the baseline, as a plain load balancer).",
    )
    qdrant_url: str | None = Field(None, description="Qdrant server; unset = embedded Qdrant under DATA_DIR/qdrant.")
    qdrant_api_key: str | None = Field(None, description="API key of the Qdrant server.")
    collection: str = Field("kvstitch_chunks", min_length=1, description="Qdrant collection name.")
    hybrid_search: bool | None = Field(
        None,
        description="Dense + BM25-style sparse search fused by RRF; unset = on with a Qdrant server, off embedded.",
    )
    filter_indexes: str = Field(
        "",
        max_length=2048,
        description="Qdrant server: payload indexes for metadata filter keys, comma-separated key:type "
        "(keyword, integer, float, datetime, bool), e.g. lang:keyword,year:integer; made at start-up.",
    )
    gpu_cache_mb: int = Field(8192, ge=0, description="GPU tier budget (MiB of chunk KV kept on the device).")
    host_cache_mb: int = Field(4096, ge=0, description="Pinned host pool, allocated once at start (MiB).")
    disk_cache_mb: int = Field(200_000, ge=0, description="Disk tier budget (MiB); least recently used files go.")
    direct_io: bool = Field(
        False, description="Read KV files with O_DIRECT into the pinned pool (faster on some cold NVMe, not all)."
    )
    kv_disk_format: Literal["native", "int8", "fp8"] = Field(
        "native",
        description="Stored form of KV files: native (bit-exact) or 8-bit int8/fp8 (half the bytes; see README).",
    )
    s3_url: str | None = Field(
        None,
        max_length=512,
        description="S3 endpoint of the shared KV tier: block files every node reads, behind the disk tier (any S3: "
        "AWS, SeaweedFS, MinIO; credentials from the standard AWS_* variables); unset = no shared tier.",
    )
    s3_bucket: str = Field(
        "kvstitch",
        pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$",
        description="Bucket of the shared KV tier (created at start when missing and allowed).",
    )
    s3_prefix: str = Field(
        "kv",
        pattern=r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$",
        max_length=256,
        description="Object name prefix of the shared KV tier, so deployments (or models) can share a bucket.",
    )
    s3_region: str | None = Field(
        None,
        pattern=r"^[a-z0-9-]{1,32}$",
        description="Region of the S3 endpoint; unset = AWS_REGION / AWS_DEFAULT_REGION, else us-east-1.",
    )
    s3_addressing: Literal["path", "virtual"] = Field(
        "path", description="S3 URL style: path (http://host/bucket/key: SeaweedFS, MinIO) or virtual (bucket.host)."
    )
    s3_timeout_s: float = Field(5.0, gt=0, le=120, description="Connect and read timeout of one shared-tier call.")
    s3_retry_after_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="After a failed shared-tier call the tier is skipped (a miss, no wait) for this long.",
    )
    max_precompute_tokens: int = Field(
        16384, ge=256, description="Tokens per batched KV precompute (worker batches and online misses)."
    )
    recompute_full_below: int = Field(
        1024,
        ge=0,
        le=1 << 20,
        description="Contexts under this many tokens serve a turbo recompute by a full prefill (exact, faster there).",
    )
    chunk_context: Literal["alone", "prefix"] = Field(
        "prefix",
        description="What a chunk's KV is precomputed after: alone, or the template prefix (APE; docs/quality.md).",
    )
    context_temperature: float = Field(
        1.0,
        ge=CONTEXT_TEMPERATURE_RANGE[0],
        le=CONTEXT_TEMPERATURE_RANGE[1],
        description="APE attention temperature on chunk keys for turbo answers (< 1 sharpens; 1 = off; "
        "docs/quality.md).",
    )
    recompute: str = Field(
        MEASURED,
        description="Recompute for turbo answers that name none: measured (what kvstitch eval --recommend found for "
        "this model, weights, dtype and chunk context; else none), none, prefix:N, selective:R[:F], query:R[:F], "
        "auto[:T] (F: the share of each chunk chosen within it first).",
    )
    shadow_share: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="Share of turbo answers also answered naive after the client's answer, off the critical path, "
        "and compared (agreement and KL metrics, /readyz); 0 = none.",
    )
    shadow_queue: int = Field(
        16, ge=1, le=1024, description="Shadow answers queued or running at most; one more is dropped and counted."
    )

    # ---- retrieval and ingestion ---------------------------------------------------------------------------
    embedding_model: str | None = Field(
        None, description="sentence-transformers model folder; unset = the bundled all-MiniLM-L6-v2."
    )
    embedding_device: str = Field("cpu", description="Device of the embedding model.")
    embedding_process: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Embed questions in a child process, so the forward never waits for the gateway's GIL (engine "
        "thread, event loop); auto = on when the LLM runs on CUDA.",
    )
    embedding_processes: int = Field(
        2,
        ge=1,
        le=8,
        description="Child processes embedding questions where they are embedded in a child (1..8): as many "
        "retrieval rounds run at once, each child on an equal share of the cores (at most 4 torch threads).",
    )
    rerank_model: str | None = Field(
        None,
        description="sentence-transformers CrossEncoder model folder that reorders the retrieved candidates "
        "before the context is fitted (runs on the embedding device); unset = no reranking.",
    )
    rerank_candidates: int = Field(
        20, ge=1, le=200, description="Retrieved candidates the reranker reads and reorders (at least top_k)."
    )
    chunk_size: int = Field(384, ge=16, le=8192, description="Chunk size in LLM tokens.")
    chunk_overlap: int = Field(48, ge=0, description="Overlap between chunks cut inside a paragraph (tokens).")
    max_document_chars: int = Field(2_000_000, ge=1, description="Largest document accepted (characters).")
    max_documents_per_job: int = Field(1000, ge=1, description="Documents one ingest job may carry.")
    max_job_tokens: int = Field(
        4_000_000, ge=1, description="LLM tokens the documents of one ingest job may hold; more is a 413 at submit."
    )
    job_max_attempts: int = Field(3, ge=1, description="Deliveries of an ingest job before it is dead-lettered.")
    job_claim_idle_ms: int = Field(
        60_000, ge=100, description="A job pending this long on a silent worker is claimed by another."
    )
    shutdown_timeout_s: float = Field(
        10.0,
        gt=0,
        description="On SIGTERM: time for open requests, then for the worker to hand its job back (seconds).",
    )

    inprocess_worker: Literal["auto", "on", "off"] = Field(
        "auto", description="Run the ingest worker inside the gateway; auto = when Redis or a Qdrant server is unset."
    )
    worker_metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of `kvstitch worker`'s Prometheus metrics (on KVSTITCH_HOST); unset = none.",
    )

    # ---- gateway -------------------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port the gateway listens on.")
    api_key: str | None = Field(None, description="Bearer token required on every route but health and metrics.")
    max_request_mb: int = Field(64, ge=1, description="Largest request body accepted (MiB); larger gets 413.")
    max_upload_files: int = Field(100, ge=1, le=1000, description="Files one POST /ingest/files may carry.")
    max_upload_file_mb: int = Field(32, ge=1, description="Largest file POST /ingest/files accepts (MiB); 413 above.")
    max_queue: int = Field(16, ge=1, description="Requests waiting for the engine before 503 + Retry-After.")
    step_profile_path: Path | None = Field(
        None,
        description="Benchmark aid: write a table of the device kernels (CPU: ops) of the engine's own steps here, "
        "once, for STEP_PROFILE_STEPS steps from the first after STEP_PROFILE_AFTER_S seconds with at least "
        "STEP_PROFILE_MIN_BATCH answers decoding.",
    )
    step_profile_after_s: float = Field(0.0, ge=0, le=86_400, description="See STEP_PROFILE_PATH.")
    step_profile_min_batch: int = Field(1, ge=1, le=4096, description="See STEP_PROFILE_PATH.")
    step_profile_steps: int = Field(200, ge=1, le=100_000, description="See STEP_PROFILE_PATH.")
    gc_freeze: bool = Field(
        True,
        description="Once ready, freeze the start-up heap out of Python's garbage collector, so full collections "
        "skip it (250-450 ms each otherwise).",
    )
    gc_gen0_threshold: int = Field(
        20_000,
        ge=100,
        description="Once ready, objects allocated (net) before Python's youngest-generation collection (Python's "
        "own default: 700); fewer, larger collections promote less to the older generations (~40-ms pauses).",
    )
    max_batch: int = Field(
        batching_defaults.MAX_BATCH, ge=1, le=256, description="Answers decoded together in one batched step, at most."
    )
    prefill_chunk: int = Field(
        batching_defaults.PREFILL_CHUNK,
        ge=0,
        description="Naive prompts are prefilled this many tokens a step in all, oldest first; 0 = whole.",
    )
    batch_prefill_min: int = Field(
        batching_defaults.BATCH_PREFILL_MIN,
        ge=0,
        le=256,
        description="Turbo questions admitted in one step are prefilled in one forward from this many on; 0 = never.",
    )
    prefill_with_decode: bool | None = Field(
        None,
        description="Questions admitted while answers run are prefilled in the running answers' decode step (up to "
        "4 questions of 256 tokens in all, needs BATCH_PREFILL_MIN > 0; shared chunks: up to 8 questions of "
        "1,024 tokens through CUDA graphs): one pass over the weights for both. Unset = on where decode steps run "
        "through CUDA graphs.",
    )
    overlap_decode: bool | None = Field(
        None,
        description="Launch each batched decode step before reading the previous step's tokens, so the host's "
        "per-step work overlaps the GPU's; unset = on where the decode step runs through CUDA graphs.",
    )
    late_launch: bool = Field(
        False,
        description="With overlapped decode steps, wait before each launch until shortly before the running step "
        "ends (its length from the last steps, a margin for the launch that adapts), so questions arriving "
        "meanwhile ride one step sooner; off = launch as soon as the previous step is read.",
    )
    early_prefill_below: int = Field(
        0,
        ge=0,
        le=4096,
        description="Shared chunks on CUDA, overlapped steps: while fewer answers than this run, a question admitted "
        "while a decode step runs is prefilled at once on a second stream beside it and its first token read as soon "
        "as it is there, instead of riding in the step after the one already queued; 0 = never.",
    )
    kv_pool_mb: int | None = Field(
        None, ge=1, description="KV pool of running answers (MiB); unset = 16384 on CUDA, 64 on the CPU."
    )
    shared_chunks: Literal["auto", "off", "on"] = Field(
        "auto",
        description="Turbo answers without recompute read their chunks from one shared chunk arena (each chunk held "
        "once, RoPE applied in the attention), their KV pool slab holding only prefix, question and answer. auto = "
        "where its Triton kernels run (CUDA), else the copy path (each answer's own stitched copy); on = also on "
        "the CPU (its torch reference: slow, for development); off = the copy path. On CUDA its decode steps, "
        "question prefills and questions riding in steps replay CUDA graphs. /readyz shows the path chosen.",
    )
    shared_arena_mb: int | None = Field(
        None,
        ge=1,
        description="Chunk arena of SHARED_CHUNKS=on (MiB); unset = half of the KV pool's budget, the pool keeping "
        "the other half (the two fit the memory the pool alone was given).",
    )
    max_question_chars: int = Field(4000, ge=1, description="Longest question accepted.")
    max_new_tokens_limit: int = Field(1024, ge=1, description="Largest max_new_tokens a request may ask for.")
    default_max_new_tokens: int = Field(256, ge=1, description="max_new_tokens when a request gives none.")
    max_top_k: int = Field(50, ge=1, le=50, description="Largest top_k a request may ask for.")
    max_history_messages: int = Field(
        64, ge=0, le=256, description="Earlier messages a conversation may carry (`history`, OpenAI `messages`)."
    )
    max_history_chars: int = Field(
        32_000, ge=0, description="Characters of all earlier messages of a conversation together."
    )
    retrieval_history_turns: int = Field(
        1,
        ge=0,
        le=16,
        description="Earlier user turns searched with the question, beside the question alone (two searches, "
        "fused; 0 = the question alone).",
    )
    model_aliases: str = Field(
        "", description="Comma-separated names /v1 also answers to, besides the served model's (e.g. gpt-4o-mini)."
    )

    # ---- robustness: locks, connections, extraction, clean-up (one block, kept together) --------------------
    doc_lock_ttl_ms: int | None = Field(
        None,
        ge=100,
        description="Redis form: expiry of a document's lock, which frees it when its worker died (a live holder "
        "renews it); at most JOB_CLAIM_IDLE_MS, so a job claimed from a dead worker finds it free; unset = half of "
        "JOB_CLAIM_IDLE_MS.",
    )
    max_connections: int = Field(
        1000,
        ge=1,
        description="Client connections open at once; one more is answered 503 + Retry-After and closed (the "
        "open-file limit is raised to fit it and 512 more where the hard limit allows).",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Time for a request's head to arrive, from the connection's start or the previous response; "
        "then 408 and the connection closes.",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="Longest pause between two pieces of a request body before the connection closes."
    )
    keep_alive_s: float = Field(5.0, ge=1, description="An idle kept-alive connection is closed after this long.")
    extract_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Time to read one uploaded file (HTML, PDF) to text; the reading process is then killed and "
        "the upload refused with a 422 naming the file.",
    )
    extract_processes: int = Field(
        2, ge=1, le=32, description="Uploaded files read at once, each in a child process of its own."
    )
    kv_sweep_grace_s: float = Field(
        600.0,
        ge=0,
        description="At start, KV blocks that no point names are released if stored longer ago than this (newer "
        "ones may belong to a job under way in another process).",
    )

    @field_validator("recompute")
    @classmethod
    def _check_recompute(cls, value: str) -> str:
        value = value.strip()
        if value != MEASURED:
            parse_recompute(value)  # a bad default fails at start-up, not on the first question
        return value

    @field_validator("s3_url")
    @classmethod
    def _check_s3_url(cls, value: str | None) -> str | None:
        if not value:
            return None  # set but empty: no shared tier, as unset
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"s3_url {value!r} is not an http(s) URL")
        return value

    @field_validator("filter_indexes")
    @classmethod
    def _check_filter_indexes(cls, value: str) -> str:
        parse_filter_indexes(value)
        return value

    @property
    def filter_index_types(self) -> dict[str, str]:
        return parse_filter_indexes(self.filter_indexes)

    @model_validator(mode="after")
    def _check_consistency(self) -> Settings:
        if self.chunk_overlap > self.chunk_size // 2:
            raise ValueError(f"chunk_overlap must be at most chunk_size // 2 = {self.chunk_size // 2}")
        if self.engine_id is not None and self.redis_url is None:
            raise ValueError("engine_id publishes tier changes to Redis: set redis_url too")
        if self.engines.strip() == ENGINES_FROM_REDIS and self.redis_url is None:
            raise ValueError("engines=redis discovers engines in Redis: set redis_url too")
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engines: {url!r} is not an http(s) URL")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError("default_max_new_tokens must not exceed max_new_tokens_limit")
        if self.doc_lock_ttl_ms is not None and self.doc_lock_ttl_ms > self.job_claim_idle_ms:
            raise ValueError(
                f"doc_lock_ttl_ms ({self.doc_lock_ttl_ms}) must be at most job_claim_idle_ms "
                f"({self.job_claim_idle_ms}): a job claimed from a dead worker would wait for its document lock"
            )
        return self

    @property
    def doc_lock_ttl(self) -> int:
        """The document lock's expiry in ms (`doc_lock_ttl_ms`, or half the claim idle time)."""
        return self.doc_lock_ttl_ms if self.doc_lock_ttl_ms is not None else max(100, self.job_claim_idle_ms // 2)

    @property
    def model_alias_names(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.model_aliases.split(",") if name.strip())

    @property
    def kv_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else self.data_dir / "kv"

    @property
    def qdrant_path(self) -> Path:
        return self.data_dir / "qdrant"

    @property
    def worker_in_process(self) -> bool:
        """Whether the gateway runs the ingest worker itself: always without Redis (nothing else reads the queue)
        and with embedded Qdrant (no other process may open it), unless forced by `inprocess_worker`."""
        if self.inprocess_worker != "auto":
            return self.inprocess_worker == "on"
        return self.redis_url is None or self.qdrant_url is None

    @property
    def engine_urls(self) -> tuple[str, ...]:
        """The `engines` URLs (empty for `redis` discovery or none)."""
        if self.engines.strip() == ENGINES_FROM_REDIS:
            return ()
        return tuple(u.strip().rstrip("/") for u in self.engines.split(",") if u.strip())

    @property
    def gateway(self) -> bool:
        """Whether `kvstitch serve` routes questions to engine processes instead of answering them itself."""
        return bool(self.engines.strip())

    @property
    def embedded(self) -> bool:
        """True when no Redis is configured: index, queue and job status live in this process."""
        return self.redis_url is None


FILTER_INDEX_TYPES = ("keyword", "integer", "float", "datetime", "bool")


def parse_filter_indexes(value: str) -> dict[str, str]:
    """KVSTITCH_FILTER_INDEXES as {metadata key: payload index type}; ValueError naming the first wrong entry."""
    indexes: dict[str, str] = {}
    for entry in (part.strip() for part in value.split(",")):
        if not entry:
            continue
        key, _, kind = entry.rpartition(":")
        if not key or kind not in FILTER_INDEX_TYPES:
            raise ValueError(f"filter index {entry!r}: write key:type, type one of {', '.join(FILTER_INDEX_TYPES)}")
        if not FILTER_KEY.fullmatch(key) or len(key) > MAX_FILTER_KEY_CHARS:
            raise ValueError(f"filter index {entry!r}: the key is 1 to 64 letters, digits, '_', '-', dots between")
        indexes[key] = kind
    return indexes
