package kvevents

import (
	"bufio"
	"context"
	"net"
	"strings"
	"sync"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// zmq4 (v0.17.0) reads a frame's header, then its body, straight off the
// connection: two read syscalls a frame, six or more a message, which were
// most of a subscription's CPU. The sockets here speak the same TCP under
// another transport name, whose connections read through a buffer.
const bufferedTCP = "kvevents+tcp"

// bufferSize is a connection's read buffer: a few batches.
const bufferSize = 32 << 10

var registerTransport = sync.OnceValue(func() error {
	return zmq4.RegisterTransport(bufferedTCP, bufTransport{transport.New("tcp")})
})

// zmqEndpoint is the tcp:// endpoint ep on the buffered transport.
func zmqEndpoint(ep string) (string, error) {
	if err := registerTransport(); err != nil {
		return "", err
	}
	if addr, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return bufferedTCP + "://" + addr, nil
	}
	return ep, nil // zmq4 says what is wrong with it
}

type bufTransport struct{ transport.Transport }

// Dial and Listen are given the socket's context, which its Close
// cancels: the connections they make close with it (newBufConn).
func (t bufTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.Transport.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return newBufConn(ctx, c), nil
}

func (t bufTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := t.Transport.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return bufListener{Listener: l, ctx: ctx}, nil
}

type bufListener struct {
	net.Listener
	ctx context.Context
}

func (l bufListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newBufConn(l.ctx, c), nil
}

// bufConn is a connection whose reads go through r.
type bufConn struct {
	net.Conn
	r    *bufio.Reader
	stop func() bool
}

// newBufConn wraps c, which closes when ctx, its socket's, is done. zmq4
// (v0.17.0) closes the connections a socket holds when it closes, but one
// it dials or accepts meanwhile (its automatic reconnect after the
// publisher went away, an accept in flight) joins the socket after that
// and would stay open, with its reader goroutine and the peer's.
func newBufConn(ctx context.Context, c net.Conn) *bufConn {
	return &bufConn{Conn: c, r: bufio.NewReaderSize(c, bufferSize), stop: context.AfterFunc(ctx, func() { _ = c.Close() })}
}

func (c *bufConn) Read(p []byte) (int, error) { return c.r.Read(p) }

func (c *bufConn) Close() error {
	c.stop()
	return c.Conn.Close()
}
