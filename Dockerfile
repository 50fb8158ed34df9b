# syntax=docker/dockerfile:1
# faultline's images, one multi-stage file with two targets:
#
#   docker build --target agent      -t faultline/agent:0.1.0 .
#   docker build --target aggregator -t faultline/aggregator:0.1.0 .
#
# agent: glibc (Debian bookworm slim), because it dlopens libnvidia-ml (injected by the
#   NVIDIA container toolkit) and Huawei's libdcmi (mounted from the host), and runs
#   npu-smi or a site tool from the host.
# aggregator: distroless, non-root (65532); also holds the CLI, `faultline` and
#   `kubectl-faultline`, the same binary under the plugin's name
#   (`kubectl exec deploy/faultline-aggregator -- faultline status`).
#
# --build-arg VERSION, REVISION (the commit) and SOURCE (the repository URL) fill the
# OCI labels.

ARG RUST_VERSION=1.89
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
# The lockfile is the one tested: --locked refuses to resolve anything new.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile image --locked -p faultline-agent -p faultline-aggregator \
 && mkdir -p /out \
 && cp target/image/faultline-agent target/image/faultline-aggregator \
       target/image/faultline /out/ \
 && cp target/image/faultline /out/kubectl-faultline

FROM docker.io/library/debian:bookworm-slim AS agent
ARG VERSION
ARG REVISION
ARG SOURCE
LABEL org.opencontainers.image.title="faultline-agent" \
      org.opencontainers.image.description="faultline node agent: GPU/NPU health from NVML, DCMI, npu-smi, the kernel log or any JSON tool" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.vendor="faultline"
COPY --from=build /out/faultline-agent /usr/local/bin/faultline-agent
# The DaemonSet keeps only CAP_SYSLOG (for /dev/kmsg); the agent reaps what it spawns
# when it runs as PID 1.
EXPOSE 8081
ENTRYPOINT ["/usr/local/bin/faultline-agent"]

FROM gcr.io/distroless/cc-debian12:nonroot AS aggregator
ARG VERSION
ARG REVISION
ARG SOURCE
LABEL org.opencontainers.image.title="faultline-aggregator" \
      org.opencontainers.image.description="faultline aggregator (denoise, publish fault.json, quarantine) and the faultline CLI" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.vendor="faultline"
COPY --from=build /out/faultline-aggregator /out/faultline /out/kubectl-faultline /usr/local/bin/
USER 65532:65532
EXPOSE 8082
ENTRYPOINT ["/usr/local/bin/faultline-aggregator"]
