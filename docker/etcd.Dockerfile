# etcd and etcdctl from the build machine (Debian's are linked against glibc, so its loader and
# libc come along at their usual paths) and kvroute-probe for the health check. The binaries sit
# where the official image has them (/usr/local/bin), so compose.yaml works with either.
FROM scratch
ENV PATH=/usr/local/bin
COPY rootfs/ /
EXPOSE 2379 2380
ENTRYPOINT ["/usr/local/bin/etcd"]
