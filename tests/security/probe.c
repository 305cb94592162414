/* A tiny static probe the hostile-guest suite copies into a guest: it tries one attack per
 * argument and prints "NAME ok" if the kernel let it through, "NAME errno=N" if it was refused.
 * Built at test time with `gcc -static` (the default Alpine baseline has no compiler). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/keyctl.h>
#include <mqueue.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/inotify.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <dirent.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef SYS_io_uring_setup
#define SYS_io_uring_setup 425
#endif

static void report(const char *name, long rc) {
    if (rc < 0) printf("%s errno=%d\n", name, errno);
    else printf("%s ok\n", name);
}

static int child_fn(void *arg) { (void)arg; return 0; }

static long try_clone_newuser(void) {
    static char stack[65536];
    int pid = clone(child_fn, stack + sizeof stack, CLONE_NEWUSER | SIGCHLD, NULL);
    if (pid > 0) waitpid(pid, NULL, 0);
    return pid;
}

static long try_cgroup_kill(const char *path) {
    /* The shape: a nested user+mount namespace, cgroup2 mounted, cgroup.kill written. */
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS) < 0) return -1;
    if (mount("none", "/tmp", "cgroup2", 0, NULL) < 0) return -1;
    char file[512];
    snprintf(file, sizeof file, "/tmp/%s/cgroup.kill", path);
    int fd = open(file, O_WRONLY);
    if (fd < 0) return -1;
    return write(fd, "1", 1);
}

static long try_abstract(const char *name) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    size_t len = strlen(name);
    memcpy(addr.sun_path + 1, name, len);
    return connect(fd, (struct sockaddr *)&addr, sizeof(sa_family_t) + 1 + len);
}

static void mq_fill(void) {
    /* Default-sized POSIX message queues until the kernel refuses one: their bytes count per
     * user, shared with the host's user of the guest's uid. They stay until the guest ends. */
    struct mq_attr attr = {.mq_maxmsg = 10, .mq_msgsize = 8192};
    int made = 0;
    char name[64];
    for (; made < 100000; made++) {
        snprintf(name, sizeof name, "/smolvm-fill-%d", made);
        if (mq_open(name, O_CREAT | O_EXCL | O_RDWR, 0600, &attr) < 0) break;
    }
    printf("mq_fill %d errno=%d\n", made, errno);
}

static void sigpending_fill(void) {
    /* Queued real-time signals to itself until refused, then held pending while it sleeps:
     * pending signals count per user, shared with the host's user of the guest's uid. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGRTMIN);
    sigprocmask(SIG_BLOCK, &set, NULL);
    union sigval value = {.sival_int = 0};
    long queued = 0;
    while (queued < 10000000 && sigqueue(getpid(), SIGRTMIN, value) == 0) queued++;
    printf("sigpending_fill %ld errno=%d\n", queued, errno);
    fflush(stdout);
    for (;;) pause();
}

static void inotify_fill(void) {
    /* inotify instances until refused, held while it sleeps: fs.inotify.max_user_instances
     * counts them per user, a system-wide limit no rlimit lowers. */
    long made = 0;
    while (made < 1000000 && inotify_init1(IN_CLOEXEC) >= 0) made++;
    printf("inotify_fill %ld errno=%d\n", made, errno);
    fflush(stdout);
    for (;;) pause();
}

static void try_helpers(const char *seconds) {
    /* Scan for the host's per-request helpers (forks of the guest's init) and try to ptrace them. */
    time_t end = time(NULL) + atoi(seconds);
    int found = 0, attached = 0, self = getpid();
    while (time(NULL) < end) {
        DIR *proc = opendir("/proc");
        struct dirent *entry;
        while (proc && (entry = readdir(proc))) {
            int pid = atoi(entry->d_name);
            if (pid <= 1 || pid == self) continue;
            char path[64], argv0[64] = {0};
            snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
            int fd = open(path, O_RDONLY);
            if (fd < 0) continue;
            read(fd, argv0, sizeof argv0 - 1);
            close(fd);
            if (strcmp(argv0, "pytest-smolvm-nsguest")) continue;
            found++;
            if (ptrace(PTRACE_ATTACH, pid, NULL, NULL) == 0) {
                attached++;
                ptrace(PTRACE_DETACH, pid, NULL, NULL);
            }
        }
        if (proc) closedir(proc);
    }
    printf("ptrace_helpers found=%d attached=%d\n", found, attached);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        char *arg = strchr(argv[i], '=');
        if (arg) arg++;
        errno = 0;
        if (!strcmp(a, "unshare_user")) report(a, unshare(CLONE_NEWUSER));
        else if (!strcmp(a, "clone_user")) report(a, try_clone_newuser());
        else if (!strcmp(a, "mq_fill")) mq_fill();
        else if (!strcmp(a, "sigpending_fill")) sigpending_fill();
        else if (!strcmp(a, "inotify_fill")) inotify_fill();
        else if (!strcmp(a, "io_setup")) { unsigned long ctx = 0; report(a, syscall(SYS_io_setup, 1, &ctx)); }
        else if (!strcmp(a, "io_uring")) { long rc = syscall(SYS_io_uring_setup, 4, calloc(1, 256)); report(a, rc); }
        else if (!strcmp(a, "userfaultfd")) report(a, syscall(SYS_userfaultfd, 0));
        else if (!strcmp(a, "perf_event_open")) report(a, syscall(SYS_perf_event_open, calloc(1, 256), 0, -1, -1, 0));
        else if (!strcmp(a, "bpf")) report(a, syscall(SYS_bpf, 0, calloc(1, 256), 64));
        else if (!strcmp(a, "keyctl")) report(a, syscall(SYS_keyctl, KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING, 0));
        else if (!strcmp(a, "add_key")) report(a, syscall(SYS_add_key, "user", "smolvm-probe", "x", 1, KEY_SPEC_USER_KEYRING));
        else if (!strncmp(a, "request_key=", 12)) report("request_key", syscall(SYS_request_key, "user", arg, NULL, 0));
        else if (!strcmp(a, "af_packet")) report(a, socket(AF_PACKET, SOCK_RAW, 0));
        else if (!strcmp(a, "raw_socket")) report(a, socket(AF_INET, SOCK_RAW, 1));
        else if (!strcmp(a, "nf_netlink")) report(a, socket(AF_NETLINK, SOCK_RAW, 12));
        else if (!strcmp(a, "audit_netlink")) report(a, socket(AF_NETLINK, SOCK_RAW, 9));
        else if (!strcmp(a, "audit_netlink_dgram")) report(a, socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, 9));
        else if (!strcmp(a, "route_netlink")) report(a, socket(AF_NETLINK, SOCK_RAW, 0));
        else if (!strcmp(a, "mount")) report(a, mount("none", "/tmp", "tmpfs", 0, NULL));
        else if (!strcmp(a, "open_by_handle_at")) report(a, syscall(SYS_open_by_handle_at, AT_FDCWD, calloc(1, 256), 0));
        else if (!strcmp(a, "kexec_load")) report(a, syscall(SYS_kexec_load, 0, 0, NULL, 0));
        else if (!strcmp(a, "init_module")) report(a, syscall(SYS_init_module, NULL, 0, ""));
        else if (!strcmp(a, "ptrace_init")) report(a, ptrace(PTRACE_ATTACH, 1, NULL, NULL));
        else if (!strcmp(a, "ptrace_seize_init")) report(a, ptrace(PTRACE_SEIZE, 1, NULL, NULL));
        else if (!strcmp(a, "vm_read_init")) {
            char buf[16]; struct iovec local = {buf, sizeof buf}, remote = {(void *)0x400000, sizeof buf};
            report(a, process_vm_readv(1, &local, 1, &remote, 1, 0));
        } else if (!strcmp(a, "pidfd_getfd_init")) {
            long pidfd = syscall(SYS_pidfd_open, 1, 0);
            long got = -1;
            for (int fd = 0; fd < 64 && pidfd >= 0; fd++) {
                got = syscall(SYS_pidfd_getfd, pidfd, fd, 0);
                if (got >= 0) break;
            }
            report(a, pidfd < 0 ? pidfd : got);
        } else if (!strcmp(a, "mem_init")) report(a, open("/proc/1/mem", O_RDONLY));
        else if (!strncmp(a, "cgroup_kill=", 12)) report("cgroup_kill", try_cgroup_kill(arg));
        else if (!strncmp(a, "abstract=", 9)) report("abstract", try_abstract(arg));
        else if (!strncmp(a, "ptrace_helpers=", 15)) try_helpers(arg);
        else printf("%s unknown\n", a);
        fflush(stdout);
    }
    return 0;
}
