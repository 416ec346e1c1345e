"""The gateway's settings: one pydantic model, loaded like every service's.

Precedence, lowest first: defaults, ``--config FILE`` (TOML), ``PLEXRL_<FIELD>`` environment
variables (``PLEXRL_MODEL``, ``PLEXRL_PORT``...), then command-line flags.

With ``tenants_file`` every request must carry a tenant's API key and acts for that tenant alone
(:mod:`services.gateway.tenancy`); without one the gateway serves the tenant of its own
credentials (``PLEXRL_TENANT``, the default tenant) with no key, and only on a loopback address
unless ``allow_no_keys`` says otherwise.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from services.config.fields import Token64


class GatewaySettings(BaseModel):
    """Everything ``plexrl gateway`` can be told."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path = Field(
        ...,
        description="the base model's Hugging Face directory (its tokenizer is the API's; "
        "clients load it from this path)",
    )
    model_name: str = Field(
        "",
        max_length=256,
        description="the name the base model is served under, e.g. its Hugging Face id: "
        "get_server_capabilities and /v1/models list it, base_model= and model= accept it, and "
        "get_info gives it as the tokenizer id (default: the directory's path)",
    )
    model_alias: str = Field(
        "",
        max_length=256,
        description="a display name to serve the base model under instead of model_name, when "
        "clients cannot load a tokenizer by it (get_info then names the model directory)",
    )
    train_unembed: bool = Field(
        False,
        description="the trainer and inference put LoRA on the unembedding too (lm_head among "
        "their --target-modules), as Tinker's train_unembed=True asks: then that is what every "
        "training client gets, else train_unembed=True is refused",
    )
    host: str = Field("127.0.0.1", description="address the HTTP server binds")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 picks a free one)")
    base_run_id: str = Field(
        "run_gateway_base",
        pattern=r"^run_[A-Za-z0-9_-]{1,64}$",
        description="the label of base-model requests to inference, which need no run and take "
        "no run slot (older gateways submitted a run of this id to serve the base model)",
    )
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, le=1 << 31, description="largest request body accepted"
    )
    max_tokens: int = Field(
        4096, ge=1, le=65536, description="largest max_tokens one request may ask for"
    )
    max_samples: int = Field(
        64, ge=1, le=1024, description="largest number of completions per prompt (n)"
    )
    max_prompts: int = Field(
        64, ge=1, le=4096, description="largest number of prompts in one request"
    )
    max_request_tokens: int = Field(
        262_144,
        ge=1,
        le=1 << 30,
        description="largest generation one request may ask for: prompts x n x max_tokens",
    )
    max_concurrent_per_key: int = Field(
        64,
        ge=1,
        le=100_000,
        description="requests and Tinker futures one API key may have under way at once; more "
        "are answered 429",
    )
    max_inflight_requests: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="sampling requests (OpenAI completions, Tinker samples) this gateway has "
        "under way at once, across every tenant; one more is answered 429 with Retry-After at "
        "once, never queued",
    )
    max_inflight_tokens: int = Field(
        1 << 21,
        ge=1,
        le=1 << 40,
        description="tokens to generate (prompts x n x max_tokens) of the sampling requests "
        "under way at once; past it a request is answered 429 with Retry-After",
    )
    retry_after_s: float = Field(
        1.0,
        gt=0,
        le=3600,
        description="the Retry-After of a 429 for generation past the gateway's bound (an "
        "overloaded inference replica gives its own)",
    )
    max_connections: int = Field(
        1024,
        ge=16,
        le=1_000_000,
        description="open HTTP connections at once; more are closed as they arrive (kept below "
        "the process's file limit)",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="a connection that sends no request head this long is closed",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="a request body not received in this long is a 408"
    )
    keep_alive_s: float = Field(
        5.0, gt=0, le=600, description="an idle keep-alive connection is closed after this long"
    )
    tenants_file: Path | None = Field(
        None,
        description="the tenants file (plexrl tenants add writes it): with it every request "
        "needs a tenant's API key, and the gateway reaches NATS as that tenant with the seed "
        "file beside it (DIR/<tenant>.nk)",
    )
    allow_no_keys: bool = Field(
        False,
        description="without a tenants file, serve on a non-loopback address too (anyone who "
        "reaches the port then acts as this gateway's tenant)",
    )
    request_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="how long inference or the trainer may take to answer"
    )
    create_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="how long a created model may wait for the registry"
    )
    poll_s: float = Field(
        20.0, gt=0, le=40, description="how long retrieve_future holds a pending future"
    )
    future_ttl_s: float = Field(
        3600.0, gt=0, le=86400, description="how long a finished future's result is kept"
    )
    session_ttl_s: float = Field(
        120.0,
        ge=15,
        le=86400,
        description="a Tinker session silent (no request, no heartbeat; the SDK beats every "
        "10 s) this long is finished: the training runs it created are evicted",
    )
    download_ttl_s: float = Field(
        3600.0, ge=60, le=7 * 86400, description="how long a checkpoint's download URL works"
    )
    service: Token64 = Field(
        "gateway", description="service name: errors go to plexrl.errors.<service>"
    )

    def base_name(self) -> str:
        """The base model's name in the APIs."""
        return self.model_name or self.model_alias or str(self.model)

    def tokenizer_id(self) -> str:
        """What a client loads the tokenizer from: the model's name when it was given one (a
        Hugging Face id), else the model directory."""
        return self.model_name or str(self.model)
