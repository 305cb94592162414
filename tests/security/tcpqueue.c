/* Queue as much as the kernel takes on loopback TCP sockets nobody reads: N connections to a
   listener that never reads, each written (non-blocking) until EAGAIN. Prints the bytes queued
   (the senders' SIOCOUTQ plus the receivers' SIOCINQ). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <linux/sockios.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 64;
    static char buf[1 << 16];
    memset(buf, 'x', sizeof buf);
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (l < 0 || bind(l, (void *)&a, sizeof a) || listen(l, n) || getsockname(l, (void *)&a, &al)) {
        printf("error=%d\n", errno);
        return 1;
    }
    long long queued = 0;
    int *rx = calloc(n, sizeof(int)), *tx = calloc(n, sizeof(int));
    for (int i = 0; i < n; i++) {
        tx[i] = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(tx[i], (void *)&a, sizeof a)) { printf("connect_error=%d\n", errno); break; }
        rx[i] = accept(l, NULL, NULL);
        fcntl(tx[i], F_SETFL, O_NONBLOCK);
        for (;;) {
            ssize_t w = write(tx[i], buf, sizeof buf);
            if (w <= 0) break;
        }
    }
    usleep(200000);
    for (int i = 0; i < n; i++) {
        int q = 0;
        if (tx[i] > 0 && ioctl(tx[i], SIOCOUTQ, &q) == 0) queued += q;
        if (rx[i] > 0 && ioctl(rx[i], SIOCINQ, &q) == 0) queued += q;
    }
    printf("queued=%lld\n", queued);
    return 0;
}
