# kvroute's processes (indexer, router, mocker, replay, bridge) and the health probe: static
# binaries built on the host by scripts/build-images, in an image with nothing else. No shell,
# no pull.
FROM scratch
ENV PATH=/usr/local/bin
COPY bin/ /usr/local/bin/
USER 65534:65534
