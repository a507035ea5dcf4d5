# nats-server (the static binary scripts/install-deps puts in .tools/bin) and kvroute-probe for
# the health check. Same entrypoint as the official image, so compose.yaml works with either.
FROM scratch
ENV PATH=/usr/local/bin
COPY nats-server /nats-server
COPY kvroute-probe /usr/local/bin/kvroute-probe
EXPOSE 4222 6222 8222
ENTRYPOINT ["/nats-server"]
