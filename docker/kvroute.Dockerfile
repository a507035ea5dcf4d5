# kvroute's processes (indexer, router, mocker, replay, bridge, gateway) and the health probe:
# static binaries built on the host by scripts/build-images, in an image with nothing else but
# the test model folder the gateway and the engine hosts tokenize with
# (/etc/kvroute/models/chatml). No shell, no pull.
FROM scratch
ENV PATH=/usr/local/bin
COPY bin/ /usr/local/bin/
COPY models/ /etc/kvroute/models/
USER 65534:65534
